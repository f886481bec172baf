"""What the test tiers and users' own runbooks share: GPU requirements, model fixtures."""
