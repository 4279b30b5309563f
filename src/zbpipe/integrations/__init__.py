"""zbpipe seen from outside: schedule names (``names``: the one table, ``zbpipe.get_schedule_class``
and the registration into torch's ``get_schedule_class``), torch's built-in schedules as plans
(``torch_plans``), ``zbpipe.plan`` for every name (``plans``) and torchtitan (``torchtitan``).

Nothing is imported here: importing ``torchtitan`` installs the integration.
"""
