"""A stage worker, the process that holds one stage of the model: its message loop (`stage.StageWorker`), its
state and links (`state`), slots of either batching policy (`slots`, `slot_picks`), prompt steps and the
prompt-to-token KV hand-off (`prompt_steps`, `handoff`), and its side of a recovery (`recovery`, `slot_recovery`)."""
