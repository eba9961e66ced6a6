"""The command line, `draftline` (`cli/app.py`): what a user types, apart from what runs inside a flow run
(flows/). Each command, or family of commands, is a module of `cli/commands/`, and no command imports
another: what several share lives here, beside the app.

- `app.py`: the Typer app, the commands' registration and the one error handler.
- `console.py`: the consoles, the one way a command fails, the options every command means the same by.
- `prefect_api.py`: the Prefect API client the commands use (finding a run, waiting for it).
- `local_run.py`: a pipeline run in this process (`run`, and `retry` of a local run).
- `leftovers.py`: what dead runs left behind (`gc`)."""
