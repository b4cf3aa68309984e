# syntax=docker/dockerfile:1
# MLflow tracking + model registry server with the PostgreSQL driver (build context: infra/docker).
FROM python:3.11-slim
RUN python -m pip install --no-cache-dir "mlflow==3.17.2" "psycopg2-binary>=2.9"
ENV MLFLOW_DISABLE_TELEMETRY=true
COPY mlflow-entrypoint.sh /usr/local/bin/mlflow-entrypoint.sh
ENTRYPOINT ["/usr/local/bin/mlflow-entrypoint.sh"]
EXPOSE 5000
CMD ["mlflow", "server", "--host=0.0.0.0", "--port=5000"]
