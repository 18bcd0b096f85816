"""Launch environment, rank math, the Topology and the communication layer."""
