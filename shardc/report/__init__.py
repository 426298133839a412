"""Reports on a plan, read from the plan alone: tables in the user's names, plots, and the
plan exported as plain JAX code."""
