"""Float8 tensor parallelism: thin subclasses of torch's TP styles."""
