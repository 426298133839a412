"""Pipeline parallelism: a scan over layers split into stages over one mesh axis."""

from shardc.pipeline.runtime import pipeline_scan
from shardc.pipeline.schedule import Pipeline
from shardc.pipeline.stack import layers

__all__ = ["Pipeline", "layers", "pipeline_scan"]
