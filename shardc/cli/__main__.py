"""``python -m shardc.cli ...``: the ``shardc`` command."""

from shardc.cli import command

command()
