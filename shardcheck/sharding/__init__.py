"""shard: the multi-device model and the files it is saved to."""
