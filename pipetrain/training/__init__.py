"""Training options: precision and loss scaling, asynchronous weight versions and delay
compensation, deferred batch norm, lazy construction and per-layer initialization."""
