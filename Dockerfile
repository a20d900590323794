# distrib's main job (`distrib train`, the README's first command) on the host's GPUs:
#   docker build -t distrib . && docker run --rm --gpus all distrib
FROM nvidia/cuda:12.6.3-runtime-ubuntu24.04

# Ubuntu's Python; its exact package versions move with the CUDA image's Ubuntu release, so they are not pinned.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/*

ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1
RUN python3 -m venv "$VIRTUAL_ENV"

WORKDIR /opt/distrib
COPY pyproject.toml setup.py README.md ./
COPY distrib ./distrib
COPY kernels ./kernels
COPY examples ./examples
RUN pip install --no-cache-dir "/opt/distrib[cuda12,train]"

# the Ubuntu 24.04 image's own unprivileged user, "ubuntu", writing its run directory under its home
USER 1000
WORKDIR /home/ubuntu

CMD ["distrib", "train"]
