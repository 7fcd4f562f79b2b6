"""Resource monitoring during training and the reports drawn from it."""
