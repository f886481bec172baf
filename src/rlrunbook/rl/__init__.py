"""The training system: tasks, rewards, paradigms, advantages, training modes, and the loop."""
