"""How stage worker processes start: a worker's entry point (`bootstrap`), the zygote that forks workers with their
imports done (`zygote`), and the launchers that start them here or elsewhere (`launchers`)."""
