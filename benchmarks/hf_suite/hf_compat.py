"""pytest plugin, loaded in the unpatched and the patched run alike: bridges the assembled test tree's
two sources (see assemble.py).

The generation and model test files come from a source tree whose `ModelTesterMixin` has a
`prepare_config_and_inputs_for_common()` method; the sdist's tests/test_modeling_common.py (the installed
version's) has not, and its own tests call `self.model_tester.prepare_config_and_inputs_for_common()`.
Where the method is missing it is added, delegating to the model tester. Nothing else is changed.
"""

import sys


def pytest_collection_finish(session):
    common = sys.modules.get("tests.test_modeling_common")
    mixin = getattr(common, "ModelTesterMixin", None)
    if mixin is not None and not hasattr(mixin, "prepare_config_and_inputs_for_common"):
        def prepare_config_and_inputs_for_common(self):
            return self.model_tester.prepare_config_and_inputs_for_common()

        mixin.prepare_config_and_inputs_for_common = prepare_config_and_inputs_for_common
