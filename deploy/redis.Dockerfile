# Redis from Debian's package, for a stack that cannot pull redis:7 (no registry). Any Debian
# or Ubuntu base does; its AOF goes to /data (a volume in docker-compose.yml).
ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE}
RUN apt-get update && apt-get install -y --no-install-recommends redis-server \
    && rm -rf /var/lib/apt/lists/* && mkdir -p /data && chown redis:redis /data
WORKDIR /data
USER redis
EXPOSE 6379
ENTRYPOINT ["redis-server", "--bind", "0.0.0.0", "--protected-mode", "no", "--dir", "/data"]
CMD ["--appendonly", "yes", "--appendfsync", "everysec", "--save", ""]
