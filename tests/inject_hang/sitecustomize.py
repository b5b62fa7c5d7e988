"""Put on PYTHONPATH by test_distributed's hang test: in a torchrun worker of the first attempt
whose RANK is SCALETRAIN_TEST_HANG_RANK, the step after SCALETRAIN_TEST_HANG_AFTER_STEP never ends
(a stand-in for a stuck filesystem or a collective that no timeout ends). Restarted workers
(TORCHELASTIC_RESTART_COUNT > 0) train normally."""

import os

if (os.environ.get("SCALETRAIN_TEST_HANG_RANK") == os.environ.get("RANK")
        and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0"):
    import time

    from scaletrain.train import trainer

    _train_step = trainer.Trainer.train_step
    _after = int(os.environ["SCALETRAIN_TEST_HANG_AFTER_STEP"])

    def train_step(self, *args, **kwargs):
        if self.step == _after:
            time.sleep(3600)
        return _train_step(self, *args, **kwargs)

    trainer.Trainer.train_step = train_step
