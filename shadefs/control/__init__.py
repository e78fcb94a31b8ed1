"""The `.shadefs` control directory: its files, the ctl commands and the sampler channel."""
