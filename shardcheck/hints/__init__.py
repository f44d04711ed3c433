"""The hints file: its model, its JSON codec, reading and writing it, comparing two."""
