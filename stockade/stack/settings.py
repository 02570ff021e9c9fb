"""The `stack:` section of stockade.yaml: how `stockade up` keeps its components running."""

from pydantic import BaseModel, ConfigDict, Field


class StackSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    # first delay before `stockade up` restarts a component that died; doubles per failure
    restart_delay_s: float = Field(0.5, gt=0)
    restart_delay_max_s: float = Field(30.0, gt=0)  # ... up to this
    # a component up this long counts as healthy: its next restart starts from
    # restart_delay_s again (a crash loop keeps doubling it)
    stable_after_s: float = Field(30.0, gt=0)
    # deaths in a row, each within stable_after_s of its start, after which `stockade up`
    # gives up: it stops everything and exits 1 with the component's last log lines
    max_fast_failures: int = Field(5, ge=1)
