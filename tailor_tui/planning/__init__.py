"""From a recipe to the work: recipes (`recipe`; the one the composer is making, `recipe_draft`), the plan checked
against its checkpoints
(`plan`), what happens to every file of the base (`file_plan`), the job contract between the
planner and the workers (`jobs`), and the output folder's rules (`output`).
"""

# its public API is its modules
__all__ = ["build", "file_plan", "jobs", "output", "plan", "provenance", "recipe", "recipe_draft", "replaceable"]
