# syntax=docker/dockerfile:1
# The serving image that k8s/rayservice.yaml runs: a CUDA runtime base and this project installed by
# scripts/install, the install scripts/setup runs for a development checkout (there with the test extra).
# KubeRay starts `ray start ...` in it through `bash -lc`; Serve imports `deployments.app`.
#   docker build -t loraserve:0.1.0 .
ARG CUDA_IMAGE=nvidia/cuda:13.0.0-runtime-ubuntu24.04
FROM ${CUDA_IMAGE}

# python3-dev and gcc: Triton compiles its kernel launchers at run time; wget: KubeRay's default probes.
# Versions come with the base image's Ubuntu release (pins would break as its archive moves on).
# hadolint ignore=DL3008
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      python3 python3-venv python3-dev gcc libc6-dev wget ca-certificates \
 && rm -rf /var/lib/apt/lists/*

# torch's CUDA build for the base image's CUDA; Ray pinned to the manifests' rayVersion, which KubeRay
# expects the image to run.
ARG TORCH_SPEC=torch==2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu130
ARG RAY_VERSION=2.60.0
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1

WORKDIR /app
COPY . /app
# KubeRay runs its commands in a login shell, whose /etc/profile resets PATH: profile.d puts the venv back.
# Ray's images run as user `ray` (uid 1000), which Ubuntu's images give to `ubuntu`.
# hadolint ignore=SC2016
RUN --mount=type=cache,target=/root/.cache/pip \
    echo "ray==${RAY_VERSION}" > /tmp/ray-pin.txt \
 && VENV=/opt/venv PIP_CONSTRAINT=/tmp/ray-pin.txt TORCH_SPEC="${TORCH_SPEC}" TORCH_INDEX_URL="${TORCH_INDEX_URL}" \
      bash scripts/install \
 && rm /tmp/ray-pin.txt \
 && echo 'export PATH=/opt/venv/bin:$PATH' > /etc/profile.d/loraserve-venv.sh \
 && if id ubuntu >/dev/null 2>&1; then userdel --remove ubuntu; fi \
 && useradd --create-home --uid 1000 ray

USER 1000
EXPOSE 8000
# Without KubeRay (which replaces the command): the app on this machine, the embedded demo by default.
CMD ["serve", "run", "deployments.app"]
