"""Model sources (where weights come from) and the readers that turn them into a runnable model."""
