"""The KV a stage keeps elsewhere so that it outlives the stage: replicas of static microbatches
(`replication`) and of continuous slots, piece by piece (`slot_replicas`), in a neighbour's memory or a store."""
