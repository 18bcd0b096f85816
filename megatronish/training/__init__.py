"""The training loop and its helpers: the job it runs (config -> topology, data, model),
stop requests, progress, profiling, non-finite steps, precision and device peaks."""
