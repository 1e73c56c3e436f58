# Prometheus (and promtool) from Debian's package, for a stack that cannot pull
# prom/prometheus (no registry). The config and rule files are mounted (docker-compose.yml).
# No --web.enable-lifecycle: its /-/quit and /-/reload take a POST from anyone (a web page
# included); a changed rule file takes a restart of the container.
ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE}
RUN apt-get update && apt-get install -y --no-install-recommends prometheus \
    && rm -rf /var/lib/apt/lists/* && mkdir -p /prometheus && chown prometheus:prometheus /prometheus
USER prometheus
EXPOSE 9090
ENTRYPOINT ["prometheus", "--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus", \
            "--web.listen-address=0.0.0.0:9090"]
