"""What the test tiers and users' own runbooks share: GPU, vLLM, TRL and real-data requirements, generated data,
model fixtures."""
