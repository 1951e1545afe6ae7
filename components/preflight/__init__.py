"""The preflight stage: benchmark the fleet and check the plan before any GPU hour is spent."""
