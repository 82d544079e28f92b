"""The head, which schedules requests through the stages: the ledger of what is in flight (`ledger*`), the
submissions it admits (`submissions`), what it receives (`receiver`), the fleet of workers and spares it runs
(`fleet`, `spares`), and recovery: from a dead stage (`recovery`, `recovery_slots`, `recoveries`, `resume`) and by a
controller's successor (`takeover`)."""
