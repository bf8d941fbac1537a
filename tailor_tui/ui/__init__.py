"""The Textual front end. Nothing outside this package imports Textual."""
