"""The folders of a rules directory, one kind of rule file each. Apart from the models
(schemawalk.KIND_MODELS) so that the CLI's parser can offer them as choices without
importing the schema and pydantic."""

from __future__ import annotations

KINDS = ("apis", "presets", "profiles", "tests", "catalogues")
