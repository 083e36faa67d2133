"""The project config: the YAML file parsed into typed settings (project.py: ProjectConfig, load_project),
errors naming the file and the key. ConfigError, the error of a config or of a command's arguments, is
imported from here by users of the Python API (docs/guide/python-api.md)."""

from habitus.pipelines.config.file import ConfigError

__all__ = ["ConfigError"]
