{{/* Names, labels and the pieces every fleetrl workload shares. */}}

{{- define "fleetrl.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "fleetrl.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The name of one component's objects: fleetrl.component (dict "ctx" $ "component" "trainer") */}}
{{- define "fleetrl.component" -}}
{{- printf "%s-%s" (include "fleetrl.fullname" .ctx) .component -}}
{{- end -}}

{{- define "fleetrl.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .ctx.Chart.Name .ctx.Chart.Version | replace "+" "_" }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
fleetrl.io/run: {{ include "fleetrl.runName" .ctx | quote }}
{{ include "fleetrl.selectorLabels" . }}
{{- end -}}

{{/* The run's name: the `run` label of every series (the ServiceMonitor copies the pods' fleetrl.io/run label),
     which the Grafana dashboard's $run variable selects. run.name, else the release name. */}}
{{- define "fleetrl.runName" -}}
{{- default .Release.Name .Values.run.name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "fleetrl.selectorLabels" -}}
app.kubernetes.io/name: {{ include "fleetrl.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* Every pod of the release (the NetworkPolicy's peers). */}}
{{- define "fleetrl.releaseSelector" -}}
app.kubernetes.io/name: {{ include "fleetrl.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "fleetrl.image" -}}
{{- printf "%s:%s" .Values.image.repository .Values.image.tag -}}
{{- end -}}

{{- define "fleetrl.secretName" -}}
{{- default (include "fleetrl.component" (dict "ctx" . "component" "auth")) .Values.auth.existingSecret -}}
{{- end -}}

{{/* The Secret with the tracker and hub tokens: secrets.existingSecret, else the chart's own (empty when
     neither holds anything). */}}
{{- define "fleetrl.tokensSecretName" -}}
{{- if .Values.secrets.existingSecret -}}
{{- .Values.secrets.existingSecret -}}
{{- else if or .Values.secrets.wandbApiKey .Values.secrets.hfToken -}}
{{- include "fleetrl.component" (dict "ctx" . "component" "tokens") -}}
{{- end -}}
{{- end -}}

{{/* Token env vars from that Secret: fleetrl.tokenEnv (dict "ctx" $ "tokens" (list "wandb" "hf")). */}}
{{- define "fleetrl.tokenEnv" -}}
{{- $s := .ctx.Values.secrets -}}
{{- $name := include "fleetrl.tokensSecretName" .ctx -}}
{{- $vars := dict "wandb" (list "WANDB_API_KEY" $s.wandbApiKeyKey $s.wandbApiKey) "hf" (list "HF_TOKEN" $s.hfTokenKey $s.hfToken) -}}
{{- range $token := .tokens }}
{{- $var := index $vars $token }}
{{- if or $s.existingSecret (index $var 2) }}
- name: {{ index $var 0 }}
  valueFrom:
    secretKeyRef:
      name: {{ $name }}
      key: {{ ternary (index $var 1) (index $var 0) (not (empty $s.existingSecret)) }}
      {{- if $s.existingSecret }}
      optional: true
      {{- end }}
{{- end }}
{{- end }}
{{- end -}}

{{- define "fleetrl.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "fleetrl.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The prompt rows: where the controller reads them (--rows), and the file name a download keeps. */}}
{{- define "fleetrl.dataFileName" -}}
{{- $name := base (urlParse .Values.run.data.url).path -}}
{{- if or (eq $name "/") (eq $name ".") (eq $name "") -}}rows.jsonl{{- else -}}{{ $name }}{{- end -}}
{{- end -}}
{{- define "fleetrl.rowsFile" -}}
{{- $d := .Values.run.data -}}
{{- if eq $d.source "volume" -}}
{{- printf "/var/lib/fleetrl/data/%s" (trimPrefix "/" $d.claimPath) -}}
{{- else if eq $d.source "url" -}}
{{- printf "/var/lib/fleetrl/data/%s" (include "fleetrl.dataFileName" .) -}}
{{- else -}}
{{- $d.file -}}
{{- end -}}
{{- end -}}

{{/* "true" when the run needs a KL reference: reference.enabled, or with auto kl_beta > 0 (fleetrl's default
     0.001 when run.config has no kl_beta) or a distillation teacher (run.config.teacher_model: the reference holds
     it) and full fine-tuning: a LoRA run (lora_rank > 0) takes its reference logprobs from the base weights with
     the adapter disabled, in the trainer. */}}
{{- define "fleetrl.referenceNeeded" -}}
{{- $enabled := .Values.reference.enabled -}}
{{- if eq (toString $enabled) "auto" -}}
{{- $kl := 0.001 -}}
{{- if hasKey .Values.run.config "kl_beta" -}}{{- $kl = .Values.run.config.kl_beta -}}{{- end -}}
{{- $lora := 0 -}}
{{- if hasKey .Values.run.config "lora_rank" -}}{{- $lora = .Values.run.config.lora_rank -}}{{- end -}}
{{- if and (or (gt (float64 $kl) 0.0) .Values.run.config.teacher_model) (eq (int $lora) 0) -}}true{{- end -}}
{{- else if $enabled -}}true{{- end -}}
{{- end -}}

{{/* "true" when the reference runs as its own service (a Deployment and Service): it is needed and
     reference.placement is "service". With placement "trainer" (the default) it is a frozen copy in the trainer's
     ranks (--reference local): no pod, no GPU of its own. */}}
{{- define "fleetrl.referenceEnabled" -}}
{{- if and (include "fleetrl.referenceNeeded" .) (eq (toString (default "trainer" .Values.reference.placement)) "service") -}}true{{- end -}}
{{- end -}}

{{/* The trainer's --reference: the service's address, or `local` for the copy in the trainer's ranks. */}}
{{- define "fleetrl.trainerReference" -}}
{{- if include "fleetrl.referenceEnabled" . -}}{{ include "fleetrl.referenceAddress" . }}{{- else -}}local{{- end -}}
{{- end -}}

{{/* A reference service's dtype: the trainer's compute dtype, so the KL is of like with like (run.config
     compute_dtype; auto is bfloat16 on a GPU trainer, else run.config.dtype, as the trainer resolves it). */}}
{{- define "fleetrl.referenceDtype" -}}
{{- $c := .Values.run.config -}}
{{- $compute := toString (default "auto" $c.compute_dtype) -}}
{{- if ne $compute "auto" -}}{{ $compute }}
{{- else if gt (int (include "fleetrl.trainerGpus" .)) 0 -}}bfloat16
{{- else -}}{{ default "float32" $c.dtype }}{{- end -}}
{{- end -}}

{{/* Addresses the services reach each other at (Service names; inference replicas by their pod names). */}}
{{- define "fleetrl.controllerAddress" -}}
{{- printf "%s:%d" (include "fleetrl.component" (dict "ctx" . "component" "controller")) (int .Values.controller.grpcPort) -}}
{{- end -}}
{{- define "fleetrl.trainerHost" -}}
{{- include "fleetrl.component" (dict "ctx" . "component" "trainer") -}}
{{- end -}}

{{/* The trainer's layout: nodes (pods), GPUs per pod (gpusPerNode, else the older `gpus`) and ranks per pod
     (procsPerNode, else one per GPU, else 1). */}}
{{- define "fleetrl.trainerNodes" -}}
{{- int (default 1 .Values.trainer.nodes) -}}
{{- end -}}
{{- define "fleetrl.trainerGpus" -}}
{{- $t := .Values.trainer -}}
{{- if kindIs "invalid" $t.gpusPerNode }}{{ int $t.gpus }}{{ else }}{{ int $t.gpusPerNode }}{{ end -}}
{{- end -}}
{{- define "fleetrl.trainerProcs" -}}
{{- $t := .Values.trainer -}}
{{- if kindIs "invalid" $t.procsPerNode }}{{ max 1 (int (include "fleetrl.trainerGpus" .)) }}{{ else }}{{ int $t.procsPerNode }}{{ end -}}
{{- end -}}
{{/* The headless Service of a multi-node trainer's pods, and the rendezvous endpoint: pod 0's stable DNS name
     through it, <trainer>-0.<trainer>-nodes.<namespace>.svc:<rendezvousPort>. */}}
{{- define "fleetrl.trainerHeadless" -}}
{{- printf "%s-nodes" (include "fleetrl.trainerHost" .) -}}
{{- end -}}
{{- define "fleetrl.trainerPodDomain" -}}
{{- printf "%s.%s.svc" (include "fleetrl.trainerHeadless" .) .Release.Namespace -}}
{{- end -}}
{{- define "fleetrl.trainerRendezvous" -}}
{{- printf "%s-0.%s:%d" (include "fleetrl.trainerHost" .) (include "fleetrl.trainerPodDomain" .) (int .Values.trainer.rendezvousPort) -}}
{{- end -}}
{{- define "fleetrl.referenceAddress" -}}
{{- printf "%s:%d" (include "fleetrl.component" (dict "ctx" . "component" "reference")) (int .Values.reference.grpcPort) -}}
{{- end -}}

{{/* The run flags controller, trainer and gateways share: run.toml plus the container paths. */}}
{{- define "fleetrl.runArgs" -}}
- --config
- /etc/fleetrl/run/run.toml
- --set
- base_model={{ .Values.model.path }}
- --set
- log_path=/var/lib/fleetrl/run
{{- end -}}

{{- define "fleetrl.env" -}}
- name: FLEETRL_AUTH_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "fleetrl.secretName" . }}
      key: token
- name: FLEETRL_LOG_LEVEL
  value: {{ .Values.logLevel | quote }}
- name: PYTHONPATH
  value: /etc/fleetrl/user
{{- end -}}

{{/* Mounts every container has: run config, user files, the model, writable /tmp, home (the Hugging Face and
     vLLM caches) and /var/lib/fleetrl (the working directory and the run's log folder) over a read-only root. */}}
{{- define "fleetrl.volumeMounts" -}}
- name: run-config
  mountPath: /etc/fleetrl/run
  readOnly: true
- name: user-files
  mountPath: /etc/fleetrl/user
  readOnly: true
{{- if .Values.model.volume }}
- name: model
  mountPath: {{ .Values.model.path }}
  readOnly: true
{{- end }}
{{- if and .Values.model.teacherVolume .Values.run.config.teacher_model }}
- name: teacher
  mountPath: {{ .Values.run.config.teacher_model }}
  readOnly: true
{{- end }}
- name: tmp
  mountPath: /tmp
- name: home
  mountPath: /home/fleetrl
- name: work
  mountPath: /var/lib/fleetrl
{{- end -}}

{{- define "fleetrl.volumes" -}}
- name: run-config
  configMap:
    name: {{ include "fleetrl.component" (dict "ctx" . "component" "config") }}
    items:
      - key: run.toml
        path: run.toml
- name: user-files
  configMap:
    name: {{ include "fleetrl.component" (dict "ctx" . "component" "user-files") }}
{{- if .Values.model.volume }}
- name: model
{{- toYaml .Values.model.volume | nindent 2 }}
{{- end }}
{{- if and .Values.model.teacherVolume .Values.run.config.teacher_model }}
- name: teacher
{{- toYaml .Values.model.teacherVolume | nindent 2 }}
{{- end }}
- name: tmp
  emptyDir: {}
- name: home
  emptyDir: {}
- name: work
  emptyDir: {}
{{- end -}}

{{/* Pod-level settings: fleetrl.podCommon (dict "ctx" $ "values" .Values.trainer) */}}
{{- define "fleetrl.podCommon" -}}
serviceAccountName: {{ include "fleetrl.serviceAccountName" .ctx }}
automountServiceAccountToken: false
{{- with .ctx.Values.imagePullSecrets }}
imagePullSecrets:
{{- toYaml . | nindent 2 }}
{{- end }}
securityContext:
{{- toYaml .ctx.Values.podSecurityContext | nindent 2 }}
{{- with .values.nodeSelector }}
nodeSelector:
{{- toYaml . | nindent 2 }}
{{- end }}
{{- with .values.tolerations }}
tolerations:
{{- toYaml . | nindent 2 }}
{{- end }}
{{- with .values.affinity }}
affinity:
{{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* Resources with the GPU request added: fleetrl.resources (dict "values" .Values.inference) */}}
{{- define "fleetrl.resources" -}}
{{- $res := deepCopy (default dict .values.resources) -}}
{{- if gt (int .values.gpus) 0 -}}
{{- $limits := deepCopy (default dict $res.limits) -}}
{{- $_ := set $limits "nvidia.com/gpu" (int .values.gpus) -}}
{{- $_ := set $res "limits" $limits -}}
{{- end -}}
{{- toYaml $res -}}
{{- end -}}

{{- define "fleetrl.podAnnotations" -}}
prometheus.io/scrape: "true"
prometheus.io/port: {{ .port | quote }}
prometheus.io/path: /metrics
checksum/config: {{ include (print .ctx.Template.BasePath "/configmap.yaml") .ctx | sha256sum }}
{{- with .ctx.Values.podAnnotations }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* One TOML value from a values entry: whole numbers as integers (values arrive as floats), strings quoted,
     lists and maps inline. */}}
{{- define "fleetrl.tomlValue" -}}
{{- $k := kindOf . -}}
{{- if eq $k "float64" -}}
{{- if eq (floor .) . }}{{ int64 . }}{{ else }}{{ . }}{{ end -}}
{{- else if eq $k "string" -}}
{{- toJson . -}}
{{- else if eq $k "slice" -}}
[{{ range $i, $e := . }}{{ if $i }}, {{ end }}{{ include "fleetrl.tomlValue" $e }}{{ end }}]
{{- else if eq $k "map" -}}
{{ "{" }}{{ $m := . }}{{ range $i, $key := keys . | sortAlpha }}{{ if $i }}, {{ end }}{{ toJson $key }} = {{ include "fleetrl.tomlValue" (index $m $key) }}{{ end }}{{ "}" }}
{{- else -}}
{{- . -}}
{{- end -}}
{{- end -}}

{{/* run.config as the [run] table's lines; null values are left out (fleetrl's default applies). */}}
{{- define "fleetrl.runToml" -}}
{{- $config := .Values.run.config -}}
{{- range $key := keys $config | sortAlpha }}
{{- $value := index $config $key }}
{{- if not (kindIs "invalid" $value) }}
{{ $key }} = {{ include "fleetrl.tomlValue" $value }}
{{- end }}
{{- end }}
{{- end -}}

{{/* Every inference replica's gRPC address, space-separated: <name>-<n>.<name>:<port> (StatefulSet pod DNS). */}}
{{- define "fleetrl.inferenceAddresses" -}}
{{- $inference := include "fleetrl.component" (dict "ctx" . "component" "inference") -}}
{{- $addresses := list -}}
{{- range $i := until (int .Values.inference.replicas) -}}
{{- $addresses = append $addresses (printf "%s-%d.%s:%d" $inference $i $inference (int $.Values.inference.grpcPort)) -}}
{{- end -}}
{{- join " " $addresses -}}
{{- end -}}
