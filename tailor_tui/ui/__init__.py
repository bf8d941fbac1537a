"""The Textual front end. Nothing outside this package imports Textual."""

# its public API is its modules
__all__ = ["actions", "app", "composer", "describe", "dialogs", "grid", "grid_lines", "health_pane", "loss_curve",
           "messages", "plain", "progress_screen"]
