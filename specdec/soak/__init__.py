"""Load and soak: the roles as child processes (`services`), N concurrent
mixed streams (`load`), faults injected on a schedule, and what was found
(`report`); `run.run_soak` puts them together, `specd soak` is the command."""
