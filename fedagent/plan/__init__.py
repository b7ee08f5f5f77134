"""The run's plan before any training: task lists, the fixed validation set, the clients of each round."""
