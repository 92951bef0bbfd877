"""lmscope: a team-shared GPU service that measures how transformer language models work."""

__version__ = "0.1.0"
