FROM python:3.11-slim
WORKDIR /app
# The CPU build of torch; a bare `pip install torch` would pull a multi-GB CUDA build.
RUN pip install --no-cache-dir torch==2.13.0 --extra-index-url https://download.pytorch.org/whl/cpu
COPY . .
RUN pip install --no-cache-dir . && kvserve model init /models/tiny-llama --arch llama
ENTRYPOINT ["kvserve"]
