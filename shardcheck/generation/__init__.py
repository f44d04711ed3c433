"""gen: the options, the default mode and Polygraphy's mode."""
