"""Pipeline parallelism: schedules (pure op lists), p2p communication and the executor."""
