"""What the sampler steers: the importance table, PADS orders and the wire formats."""
