"""What travels between the head and the stage workers: the typed messages and their codec (`messages`), and the
TLS that guards the links (`link_tls`)."""
