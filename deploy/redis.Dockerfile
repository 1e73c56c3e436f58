# Redis from Debian's package, for a stack that cannot pull redis:7 (no registry). Any Debian
# or Ubuntu base does; its AOF goes to /data (a volume in docker-compose.yml). redis-entrypoint.sh
# turns env RLMESH_REDIS_PASSWORD into an ACL user and refuses to start without it.
ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE}
RUN apt-get update && apt-get install -y --no-install-recommends redis-server \
    && rm -rf /var/lib/apt/lists/* && mkdir -p /data && chown redis:redis /data
COPY deploy/redis-entrypoint.sh /usr/local/bin/rlmesh-redis
WORKDIR /data
USER redis
EXPOSE 6379
ENTRYPOINT ["/usr/local/bin/rlmesh-redis"]
CMD ["--appendonly", "yes", "--appendfsync", "everysec", "--save", ""]
