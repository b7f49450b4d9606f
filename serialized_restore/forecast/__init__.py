"""``serialized-restore forecast``: before a resume, how much host memory it adds per node, upstream and serialized,
from the checkpoint's tensor table alone (no tensor data is read). The model: ``docs/forecast.md``.

    table = read_table("last.ckpt")                       # local path or fsspec URL; CannotForecast if it cannot be
    forecast = predict(table, devices=8, entry="fit")     # the bytes each way of resuming adds per node
    print(render(forecast, memory_available()))
"""

from serialized_restore._host import Available, memory_available
from serialized_restore.forecast.model import Forecast, Resume, predict
from serialized_restore.forecast.report import render, to_json
from serialized_restore.forecast.sources import read_table
from serialized_restore.forecast.table import CannotForecast, TensorTable

__all__ = [
    "Available",
    "CannotForecast",
    "Forecast",
    "Resume",
    "TensorTable",
    "memory_available",
    "predict",
    "read_table",
    "render",
    "to_json",
]
