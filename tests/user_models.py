"""Source of the user model the tests share: written to a file, imported as ``module:make``.

It is not an ``nn.Sequential``, so it is traced with torch.fx, and fc1's output ``h`` skips
over fc2 and fc3 to be added back before the last layer: the cut after fc2 carries
``relu(fc2(h))`` *and* ``h``. Input width 8, 4 classes.
"""

SKIP_NET = """
    import torch
    from torch import nn

    class Skip(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = nn.Linear(8, 16)
            self.fc2 = nn.Linear(16, 16)
            self.fc3 = nn.Linear(16, 16)
            self.out = nn.Linear(16, 4)

        def forward(self, x):
            h = torch.tanh(self.fc1(x))
            y = torch.relu(self.fc2(h))
            z = self.fc3(y)
            return self.out(z + h)

    def make():
        return Skip()
"""
SKIP_NET_INPUTS = 8
SKIP_NET_CLASSES = 4


# A user's --data and --loss for the models above: 4 classes of a fixed random linear map of 8
# inputs (the teacher drawn from torch's seeded generator, so every rank draws the same one).
TEACHER_DATA_AND_LOSS = """
    import torch
    import torch.nn.functional as F

    def data(batch_size):
        teacher = torch.randn(8, 4)
        while True:
            x = torch.randn(batch_size, 8)
            yield x, (x @ teacher).argmax(dim=1)

    def loss(outputs, targets):
        return F.cross_entropy(outputs, targets, label_smoothing=0.1)
"""
