"""The runtime core: the pipeline, its world (threads here or one torchrun rank), stages, the
executor of a schedule's actions, transports and the step's agreement."""
