"""Pipeline parallelism: a scan over layers split into stages over one mesh axis."""

from shardc.pipeline.onefb import pipeline_loss
from shardc.pipeline.runtime import pipeline_scan
from shardc.pipeline.schedule import Pipeline
from shardc.pipeline.stack import layers, layers_loss

__all__ = ["Pipeline", "layers", "layers_loss", "pipeline_loss", "pipeline_scan"]
