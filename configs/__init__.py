"""The shipped recipes (installed as ``bertpipe.configs``): ``bertpipe configs list`` names
them, and ``--config NAME`` (the file name without ``.yaml``) resolves one."""
