"""The TensorFlow surfaces: ``tf.distribute``'s `StrategyExtended` (``_extended``) and the 2018
``tf.contrib.distribute`` names (``_legacy``: `StrategyV1Names`, `TowerContext`), mixed into every
strategy so that ported code runs.
"""

from jaxdist.strategies.tf_api._extended import StrategyExtended as StrategyExtended
from jaxdist.strategies.tf_api._legacy import StrategyV1Names as StrategyV1Names
from jaxdist.strategies.tf_api._legacy import TowerContext as TowerContext

__all__ = ["StrategyExtended", "StrategyV1Names", "TowerContext"]
