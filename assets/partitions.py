"""Where every asset sits: snapshots are dynamic partitions (one per content-addressed data
snapshot), and the whole graph is one asset group.

One group, because Dagster 1.13's asset graph draws groups only when there are several, and
then opens every group collapsed (``groupRendering: 'if-varied'`` and an empty
``expandedGroups`` in the webserver's ``asset-graph/layout.ts``): with one group a person sees
every asset and every edge from landing files to promoted model without a click.
"""

import dagster as dg

snapshot_partitions = dg.DynamicPartitionsDefinition(name="snapshots")

ASSET_GROUP = "tracks"
