"""The Textual front end. Nothing outside this package imports Textual."""

# its public API is its modules
__all__ = ["actions", "app", "composer", "describe", "dialogs", "export_actions", "grid", "grid_lines",
           "health_pane", "host", "loss_curve", "messages", "navigation", "plain", "progress_screen", "recipe_actions"]
