"""The planner: memory, communication and a roofline step time for a config on a GPU cluster."""
