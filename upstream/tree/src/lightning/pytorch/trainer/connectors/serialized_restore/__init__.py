# Copyright The Lightning AI team.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
"""Serialized checkpoint loading: ``Trainer(serialized_checkpoint_loading=...)``.

The local ranks of each node restore a checkpoint in turns instead of all at once, each freeing what it no longer
needs as soon as it is restored. ``connector.py`` runs Lightning's two restore stages in turns, ``turns.py`` decides
which rank restores when, ``readers.py`` how the bytes are read.
"""

from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector
from lightning.pytorch.trainer.connectors.serialized_restore.connector import (
    _SerializedCheckpointConnectorMixin,
    disable_checkpoint_callbacks,
)
from lightning.pytorch.trainer.connectors.serialized_restore.errors import CheckpointRestoreError, RankFailure
from lightning.pytorch.trainer.connectors.serialized_restore.options import RestoreOptions, SerializedLoading


class _SerializedCheckpointConnector(_SerializedCheckpointConnectorMixin, _CheckpointConnector):
    """The Trainer's checkpoint connector; with ``serialized_checkpoint_loading`` off it restores as
    :class:`~lightning.pytorch.trainer.connectors.checkpoint_connector._CheckpointConnector` does."""


__all__ = [
    "CheckpointRestoreError",
    "RankFailure",
    "RestoreOptions",
    "SerializedLoading",
    "_SerializedCheckpointConnector",
    "disable_checkpoint_callbacks",
]
