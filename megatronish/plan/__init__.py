"""Plan a job before launching it: memory per rank, FLOPs, communication, bubble, fit check."""
