"""What a run is, below the app and the bench: its settings (RunConfig), the
drafter specs with an engine mode (`suffix@hold4`), and the one place that
resolves the kernels and the K cache a model is loaded with.  The app
(SpecModel, the CLI, the server) and the bench both build on it; it imports
nothing above core."""
