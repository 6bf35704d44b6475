//! The single collector: steps a few environments with one policy and yields batches.
//!
//! Per batch, in this order (the order the tests check):
//!
//! 1. **weights**: new weights from the attached [`WeightSource`] (a scheme
//!    [`Receiver`], polled with a zero timeout) are applied through
//!    the collector's [`Strategy`];
//! 2. **`pre_collect_hook`** (no arguments);
//! 3. the **per-step loop**, `frames_per_batch` frames: the policy reads the carrier's
//!    observation and writes action and log-probability, the environment steps, finished
//!    environments are reset at once, their next trajectory id drawn from the shared
//!    [`TrajPool`]; each transition goes either straight into the replay buffer or into
//!    the batch;
//! 4. **`split_trajs`** (when on);
//! 5. **`postproc`** (may transform the batch);
//! 6. **`post_collect_hook`** with the batch, immediately before it is yielded.
//!
//! The **carrier** (each environment's latest reset-aware observation, its trajectory id
//! and running return) persists across batches, so a trajectory cut by a batch boundary
//! resumes in the next batch with the same id.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use rand::SeedableRng;
use rand::rngs::SmallRng;
use refit_runtime::protocol::{Admission, Group};
use refit_runtime::{
    ArenaStrategy, HasWeights, Manifest, Manifests, ModelId, Receiver, ReceiverTransport, Strategy,
    Version, WeightSet, extract_new,
};

use crate::batch::{Batch, EpisodeStats, Observation, ReplayBuffer, TrajPool, Transition};
use crate::device::Device;
use crate::env::Env;
use crate::error::{Error, Result};
use crate::policy::Policy;

/// Where a collector gets new weights from between batches.
///
/// Implemented for every scheme [`Receiver`]; a worker process would implement it over its
/// own transport the same way.
pub trait WeightSource: Send {
    /// The weights in force when the source is attached (applied once, at attach).
    fn initial(&self) -> Vec<Arc<WeightSet>>;
    /// New weights since the last poll; never blocks.
    ///
    /// # Errors
    /// A refused update or a dead sender, as the transport reports it.
    fn poll(&mut self) -> refit_runtime::Result<Option<Group>>;
}

impl<T: ReceiverTransport> WeightSource for Receiver<T> {
    fn initial(&self) -> Vec<Arc<WeightSet>> {
        self.served()
            .load()
            .iter()
            .map(|(_, w)| Arc::clone(w))
            .collect()
    }

    fn poll(&mut self) -> refit_runtime::Result<Option<Group>> {
        Ok(self.receive(Duration::ZERO)?.map(|u| u.group))
    }
}

/// Settings of one collector.
#[derive(Clone, Debug)]
pub struct CollectorConfig {
    /// Frames (environment steps, all environments together) per batch; rounded up to a
    /// multiple of the number of environments.
    pub frames_per_batch: usize,
    /// Stop after this many frames (`None`: never).
    pub total_frames: Option<u64>,
    /// Stamp each transition with a trajectory id (default on).
    pub track_traj_ids: bool,
    /// Regroup each batch by trajectory (needs `track_traj_ids`).
    pub split_trajs: bool,
    /// Where the policy runs (only CPU).
    pub policy_device: Device,
    /// Where the environments run (only CPU).
    pub env_device: Device,
    /// Where batches are stored (only CPU).
    pub storing_device: Device,
    /// Seed of the policy's sampling and of the environments' first resets.
    pub seed: u64,
    /// Worker index stamped on transitions.
    pub worker: usize,
    /// The model id of the policy's weights.
    pub policy_id: ModelId,
}

impl Default for CollectorConfig {
    fn default() -> Self {
        Self {
            frames_per_batch: 1000,
            total_frames: None,
            track_traj_ids: true,
            split_trajs: false,
            policy_device: Device::Cpu,
            env_device: Device::Cpu,
            storing_device: Device::Cpu,
            seed: 0,
            worker: 0,
            policy_id: policy_model_id(),
        }
    }
}

/// The default model id of a collector's policy: `"policy"`.
pub fn policy_model_id() -> ModelId {
    // "policy" is a valid id by construction; the fallback is never taken.
    ModelId::new("policy").unwrap_or_else(|_| unreachable!("\"policy\" is a valid model id"))
}

type PreHook = Box<dyn FnMut() -> Result<()> + Send>;
type PostHook = Box<dyn FnMut(&Batch) -> Result<()> + Send>;
type Postproc = Box<dyn FnMut(Batch) -> Result<Batch> + Send>;
type Registered = Box<dyn Fn(&ModelId) -> Result<WeightSet> + Send>;

/// Builds a [`Collector`].
pub struct CollectorBuilder<E: Env, P: Policy> {
    envs: Vec<E>,
    policy: P,
    config: CollectorConfig,
    strategy: Box<dyn Strategy<P>>,
    traj_pool: TrajPool,
    pre: Option<PreHook>,
    post: Option<PostHook>,
    postproc: Option<Postproc>,
    replay_buffer: Option<Arc<dyn ReplayBuffer>>,
    aux: Vec<(ModelId, Arc<Manifest>)>,
}

impl<E: Env, P: Policy> fmt::Debug for CollectorBuilder<E, P> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CollectorBuilder")
            .field("envs", &self.envs.len())
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl<E: Env, P: Policy + 'static> CollectorBuilder<E, P> {
    /// Replaces the whole configuration.
    #[must_use]
    pub fn config(mut self, config: CollectorConfig) -> Self {
        self.config = config;
        self
    }

    /// Frames per batch.
    #[must_use]
    pub fn frames_per_batch(mut self, n: usize) -> Self {
        self.config.frames_per_batch = n;
        self
    }

    /// Frame budget.
    #[must_use]
    pub fn total_frames(mut self, n: u64) -> Self {
        self.config.total_frames = Some(n);
        self
    }

    /// Turns trajectory ids on or off.
    #[must_use]
    pub fn track_traj_ids(mut self, on: bool) -> Self {
        self.config.track_traj_ids = on;
        self
    }

    /// Regroups batches by trajectory.
    #[must_use]
    pub fn split_trajs(mut self, on: bool) -> Self {
        self.config.split_trajs = on;
        self
    }

    /// Policy, environment and storage devices.
    #[must_use]
    pub fn devices(mut self, policy: Device, env: Device, storing: Device) -> Self {
        self.config.policy_device = policy;
        self.config.env_device = env;
        self.config.storing_device = storing;
        self
    }

    /// Seed.
    #[must_use]
    pub fn seed(mut self, seed: u64) -> Self {
        self.config.seed = seed;
        self
    }

    /// Worker index stamped on transitions.
    #[must_use]
    pub fn worker(mut self, worker: usize) -> Self {
        self.config.worker = worker;
        self
    }

    /// The policy's model id (default `"policy"`).
    #[must_use]
    pub fn policy_id(mut self, id: ModelId) -> Self {
        self.config.policy_id = id;
        self
    }

    /// How weights are applied to the policy (default [`ArenaStrategy`]).
    #[must_use]
    pub fn strategy(mut self, strategy: impl Strategy<P> + 'static) -> Self {
        self.strategy = Box::new(strategy);
        self
    }

    /// The trajectory-id pool (share one between collectors so ids never collide).
    #[must_use]
    pub fn traj_pool(mut self, pool: TrajPool) -> Self {
        self.traj_pool = pool;
        self
    }

    /// Called at the top of each batch, before the first step.
    #[must_use]
    pub fn pre_collect_hook(mut self, hook: impl FnMut() -> Result<()> + Send + 'static) -> Self {
        self.pre = Some(Box::new(hook));
        self
    }

    /// Called with each batch immediately before it is yielded.
    #[must_use]
    pub fn post_collect_hook(
        mut self,
        hook: impl FnMut(&Batch) -> Result<()> + Send + 'static,
    ) -> Self {
        self.post = Some(Box::new(hook));
        self
    }

    /// Transforms each batch (after `split_trajs`, before `post_collect_hook`).
    #[must_use]
    pub fn postproc(mut self, f: impl FnMut(Batch) -> Result<Batch> + Send + 'static) -> Self {
        self.postproc = Some(Box::new(f));
        self
    }

    /// Writes transitions straight into `buffer`; batches then carry no transitions.
    #[must_use]
    pub fn replay_buffer(mut self, buffer: Arc<dyn ReplayBuffer>) -> Self {
        self.replay_buffer = Some(buffer);
        self
    }

    /// Declares another synchronised model (a critic, a transform's module) whose weights
    /// the collector keeps alongside the policy's ([`Collector::model_weights`]).
    #[must_use]
    pub fn aux_model(mut self, id: ModelId, manifest: Arc<Manifest>) -> Self {
        self.aux.push((id, manifest));
        self
    }

    /// Checks the configuration and builds the collector.
    ///
    /// # Errors
    /// [`Error::DeviceNotSupported`] for a CUDA device; [`Error::SplitTrajsWithoutTrajIds`];
    /// [`Error::Config`] for no environment, zero frames per batch or environments that
    /// disagree on shapes; the strategy's error if the policy has no manifest.
    pub fn build(self) -> Result<Collector<E, P>> {
        let c = &self.config;
        c.policy_device.check_supported()?;
        c.env_device.check_supported()?;
        c.storing_device.check_supported()?;
        if c.split_trajs && !c.track_traj_ids {
            return Err(Error::SplitTrajsWithoutTrajIds);
        }
        if self.envs.is_empty() {
            return Err(Error::Config(
                "a collector needs at least one environment".into(),
            ));
        }
        if c.frames_per_batch == 0 {
            return Err(Error::Config("frames_per_batch must be positive".into()));
        }
        let obs_dim = self.envs[0].obs_dim();
        let num_actions = self.envs[0].num_actions();
        if self
            .envs
            .iter()
            .any(|e| e.obs_dim() != obs_dim || e.num_actions() != num_actions)
        {
            return Err(Error::Config(
                "environments of one collector must share observation and action sizes".into(),
            ));
        }
        if self.policy.obs_dim() != obs_dim || self.policy.num_actions() != num_actions {
            return Err(Error::Config(format!(
                "the policy takes observations of {} values and has {} actions, the \
                 environments give {obs_dim} values and have {num_actions} actions",
                self.policy.obs_dim(),
                self.policy.num_actions()
            )));
        }
        let policy_manifest = Arc::new(self.strategy.manifest(&self.policy)?);
        let manifests = Manifests::new(
            std::iter::once((c.policy_id.clone(), Arc::clone(&policy_manifest))).chain(self.aux),
        )?;
        // Devices are all CPU here; the cast flags are computed once, as the reference does,
        // so the per-step branches are plain bool checks.
        let cast_to_policy_device = c.policy_device != c.env_device;
        let cast_to_env_device = cast_to_policy_device || c.env_device != c.storing_device;
        let rng = SmallRng::seed_from_u64(c.seed ^ (c.worker as u64).wrapping_mul(0x9E37_79B9));
        Ok(Collector {
            obs_dim,
            envs: self.envs,
            policy: self.policy,
            strategy: self.strategy,
            config: self.config,
            admission: Admission::new(manifests),
            aux: BTreeMap::new(),
            carrier: None,
            traj_pool: self.traj_pool,
            pre: self.pre,
            post: self.post,
            postproc: self.postproc,
            replay_buffer: self.replay_buffer,
            source: None,
            registered: None,
            frames: 0,
            batches: 0,
            rng,
            cast_to_policy_device,
            cast_to_env_device,
        })
    }
}

/// The reset-aware state the next step consumes; persists across batches.
#[derive(Debug)]
struct Carrier {
    obs: Vec<Vec<f32>>,
    traj_ids: Vec<u64>,
    ep_return: Vec<f64>,
    ep_len: Vec<u32>,
}

/// A single collector: one policy, a few environments stepped side by side.
pub struct Collector<E: Env, P: Policy> {
    obs_dim: usize,
    envs: Vec<E>,
    policy: P,
    strategy: Box<dyn Strategy<P>>,
    config: CollectorConfig,
    admission: Admission,
    aux: BTreeMap<ModelId, Arc<WeightSet>>,
    carrier: Option<Carrier>,
    traj_pool: TrajPool,
    pre: Option<PreHook>,
    post: Option<PostHook>,
    postproc: Option<Postproc>,
    replay_buffer: Option<Arc<dyn ReplayBuffer>>,
    source: Option<Box<dyn WeightSource>>,
    registered: Option<Registered>,
    frames: u64,
    batches: u64,
    rng: SmallRng,
    cast_to_policy_device: bool,
    cast_to_env_device: bool,
}

impl<E: Env, P: Policy> fmt::Debug for Collector<E, P> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Collector")
            .field("envs", &self.envs.len())
            .field("config", &self.config)
            .field("version", &self.policy_version())
            .field("frames", &self.frames)
            .field("batches", &self.batches)
            .finish_non_exhaustive()
    }
}

impl<E: Env, P: Policy + 'static> Collector<E, P> {
    /// Starts building a collector over `envs` (stepped side by side) and `policy`.
    pub fn builder(envs: Vec<E>, policy: P) -> CollectorBuilder<E, P> {
        CollectorBuilder {
            envs,
            policy,
            config: CollectorConfig::default(),
            strategy: Box::new(ArenaStrategy),
            traj_pool: TrajPool::new(),
            pre: None,
            post: None,
            postproc: None,
            replay_buffer: None,
            aux: Vec::new(),
        }
    }
}

impl<E: Env, P: Policy> Collector<E, P> {
    /// The configuration.
    pub fn config(&self) -> &CollectorConfig {
        &self.config
    }

    /// The policy.
    pub fn policy(&self) -> &P {
        &self.policy
    }

    /// The version of the policy weights in force ([`Version::ZERO`] before any update).
    pub fn policy_version(&self) -> Version {
        self.admission.current(&self.config.policy_id)
    }

    /// Whether observations are cast to the policy device, and actions to the environment
    /// device, each step (computed once at build; both false while everything is on CPU).
    pub fn device_casts(&self) -> (bool, bool) {
        (self.cast_to_policy_device, self.cast_to_env_device)
    }

    /// Frames collected so far.
    pub fn frames(&self) -> u64 {
        self.frames
    }

    /// The weights of an auxiliary model, as last updated.
    pub fn model_weights(&self, id: &ModelId) -> Option<&Arc<WeightSet>> {
        self.aux.get(id)
    }

    /// The trajectory-id pool.
    pub fn traj_pool(&self) -> &TrajPool {
        &self.traj_pool
    }

    /// Replaces the trajectory-id pool (multi-worker collectors share theirs). Only before
    /// the first batch; afterwards the carrier already holds ids from the old pool.
    ///
    /// # Errors
    /// [`Error::Config`] once collection started.
    pub fn set_traj_pool(&mut self, pool: TrajPool) -> Result<()> {
        if self.carrier.is_some() {
            return Err(Error::Config(
                "the trajectory pool cannot change after collection started".into(),
            ));
        }
        self.traj_pool = pool;
        Ok(())
    }

    /// Sets the worker index stamped on transitions (multi-worker collectors do this).
    pub fn set_worker(&mut self, worker: usize) {
        self.config.worker = worker;
        self.rng =
            SmallRng::seed_from_u64(self.config.seed ^ (worker as u64).wrapping_mul(0x9E37_79B9));
    }

    /// Sets or clears the frame budget.
    pub fn set_total_frames(&mut self, total: Option<u64>) {
        self.config.total_frames = total;
    }

    /// Attaches a weight source: its current weights are applied now, its new ones before
    /// every batch.
    ///
    /// # Errors
    /// As [`Collector::apply_group`] for the initial weights.
    pub fn attach_weight_source(&mut self, source: Box<dyn WeightSource>) -> Result<()> {
        let initial = source.initial();
        if !initial.is_empty() {
            self.apply_group(&initial)?;
        }
        self.source = Some(source);
        Ok(())
    }

    /// Registers the model `update_policy_weights()` pulls weights from (the trainer's).
    pub fn register_policy<M: HasWeights + Send + 'static>(&mut self, model: Arc<Mutex<M>>) {
        self.registered = Some(registered_source(model));
    }

    /// Applies one atomic group: every weight set is checked (known model, agreed manifest,
    /// newer version) before anything is applied; then the policy's weights go through the
    /// strategy (all or nothing) and auxiliary models are swapped in.
    ///
    /// # Errors
    /// The first problem found, naming model and tensor; nothing is applied then.
    pub fn apply_group(&mut self, group: &[Arc<WeightSet>]) -> Result<()> {
        let (policy_id, strategy, policy, aux) = (
            &self.config.policy_id,
            &mut self.strategy,
            &mut self.policy,
            &mut self.aux,
        );
        self.admission.admit(group, |_| {
            if let Some(w) = group.iter().find(|w| w.model() == policy_id) {
                strategy.apply(w, policy)?;
            }
            for w in group {
                if w.model() != policy_id {
                    aux.insert(w.model().clone(), Arc::clone(w));
                }
            }
            Ok(())
        })?;
        Ok(())
    }

    fn make_carrier(&mut self) -> Result<Carrier> {
        let n = self.envs.len();
        let track = self.config.track_traj_ids;
        let ids = if track {
            self.traj_pool.take(n as u64).collect()
        } else {
            Vec::new()
        };
        let mut obs = Vec::with_capacity(n);
        for (i, env) in self.envs.iter_mut().enumerate() {
            let seed = self
                .config
                .seed
                .wrapping_add((self.config.worker as u64).wrapping_mul(1_000_003))
                .wrapping_add(i as u64);
            let o = env.reset(Some(seed))?;
            check_obs(i, &o, self.obs_dim)?;
            obs.push(o);
        }
        Ok(Carrier {
            obs,
            traj_ids: ids,
            ep_return: vec![0.0; n],
            ep_len: vec![0; n],
        })
    }

    /// Collects one batch (see the module docs for the order of events). `Ok(None)` once
    /// the frame budget is spent.
    ///
    /// # Errors
    /// A refused weight update, a failing environment or hook, a replay buffer error.
    pub fn next_batch(&mut self) -> Result<Option<Batch>> {
        if self
            .config
            .total_frames
            .is_some_and(|total| self.frames >= total)
        {
            return Ok(None);
        }
        // (0) weights: receive(0) on the scheme, apply through the strategy.
        let sync_start = Instant::now();
        if let Some(source) = self.source.as_mut()
            && let Some(group) = source.poll()?
        {
            self.apply_group(&group)?;
        }
        let weight_sync = sync_start.elapsed();
        if let Some(hook) = self.pre.as_mut() {
            hook()?;
        }
        let mut carrier = match self.carrier.take() {
            Some(c) => c,
            None => self.make_carrier()?,
        };
        let result = self.rollout(&mut carrier);
        self.carrier = Some(carrier);
        let mut batch = result?;
        batch.weight_sync = weight_sync;
        self.frames += batch.frames as u64;
        self.batches += 1;
        if self.config.split_trajs && self.replay_buffer.is_none() {
            batch.split_trajs()?;
        }
        if let Some(f) = self.postproc.as_mut() {
            batch = f(batch)?;
        }
        if let Some(hook) = self.post.as_mut() {
            hook(&batch)?;
        }
        Ok(Some(batch))
    }

    fn rollout(&mut self, carrier: &mut Carrier) -> Result<Batch> {
        let n = self.envs.len();
        let steps = self.config.frames_per_batch.div_ceil(n);
        let version = self.policy_version();
        let worker = self.config.worker;
        let track = self.config.track_traj_ids;
        let direct = self.replay_buffer.clone();
        let mut batch = Batch {
            transitions: Vec::with_capacity(if direct.is_some() { 0 } else { steps * n }),
            ..Batch::default()
        };
        for _ in 0..steps {
            for (i, env) in self.envs.iter_mut().enumerate() {
                // (1) policy (a cast to the policy device would go here; none on CPU).
                let out = self.policy.act(&carrier.obs[i], &mut self.rng);
                // (2) environment step (a cast to the env device would go here), reset if done.
                let r = env.step(out.action)?;
                check_obs(i, &r.obs, self.obs_dim)?;
                carrier.ep_return[i] += f64::from(r.reward);
                carrier.ep_len[i] += 1;
                let done = r.done();
                // the transition copies the observation after the step (inline: no
                // allocation for small ones); the carrier takes the env's vector itself
                let next_obs = Observation::from_slice(&r.obs);
                let carried = if done {
                    let o = env.reset(None)?;
                    check_obs(i, &o, self.obs_dim)?;
                    o
                } else {
                    r.obs
                };
                let traj_id = track.then(|| carrier.traj_ids[i]);
                let t = Transition {
                    obs: Observation::from(std::mem::replace(&mut carrier.obs[i], carried)),
                    action: out.action,
                    log_prob: out.log_prob,
                    reward: r.reward,
                    next_obs,
                    terminated: r.terminated,
                    truncated: r.truncated,
                    traj_id,
                    version,
                    worker,
                    env: i,
                    step: carrier.ep_len[i] - 1,
                };
                // (3a) direct replay-buffer write, or (3b) append to the batch.
                match &direct {
                    Some(rb) => rb.add(t)?,
                    None => batch.transitions.push(t),
                }
                batch.frames += 1;
                if done {
                    batch.episodes.push(EpisodeStats {
                        traj_id,
                        ret: carrier.ep_return[i],
                        len: carrier.ep_len[i],
                        worker,
                        env: i,
                        version,
                    });
                    carrier.ep_return[i] = 0.0;
                    carrier.ep_len[i] = 0;
                    if track {
                        carrier.traj_ids[i] = self.traj_pool.next_id();
                    }
                }
            }
        }
        Ok(batch)
    }
}

impl<E: Env, P: Policy> Iterator for Collector<E, P> {
    type Item = Result<Batch>;

    fn next(&mut self) -> Option<Self::Item> {
        self.next_batch().transpose()
    }
}

fn check_obs(env: usize, obs: &[f32], expected: usize) -> Result<()> {
    if obs.len() != expected {
        return Err(Error::env(
            env,
            format!(
                "observation of length {} where {expected} was declared",
                obs.len()
            ),
        ));
    }
    Ok(())
}

pub(crate) fn registered_source<M: HasWeights + Send + 'static>(
    model: Arc<Mutex<M>>,
) -> Registered {
    Box::new(move |id: &ModelId| {
        let m = model.lock().unwrap_or_else(PoisonError::into_inner);
        Ok(extract_new(&ArenaStrategy, &*m, id.clone())?)
    })
}

/// The `update_policy_weights_` calling conventions of the reference, as methods.
///
/// Versions: a weight set stamped [`Version::ZERO`] is stamped with the model's next
/// version; a stamped one must be newer than the version in force.
pub trait UpdatePolicyWeights {
    /// The policy's model id.
    fn policy_id(&self) -> &ModelId;
    /// The version in force (sent, for multi-worker collectors) of a model.
    fn version_of(&self, model: &ModelId) -> Version;
    /// Weights of the registered policy.
    ///
    /// # Errors
    /// [`Error::NoRegisteredPolicy`] when none is registered.
    fn registered_policy_weights(&mut self) -> Result<WeightSet>;
    /// Applies or publishes one atomic group: all models land, or none.
    ///
    /// # Errors
    /// A group refused whole (unknown model, wrong manifest naming the tensor, stale
    /// version), or a transport failure.
    fn update_group(&mut self, group: Vec<WeightSet>) -> Result<()>;

    /// Several models as one atomic update (e.g. actor and critic).
    ///
    /// # Errors
    /// As [`UpdatePolicyWeights::update_group`].
    fn update_many(&mut self, mut group: Vec<WeightSet>) -> Result<()> {
        for w in &mut group {
            if w.version() == Version::ZERO {
                w.set_version(self.version_of(w.model()).next());
            }
        }
        self.update_group(group)
    }

    /// One named model.
    ///
    /// # Errors
    /// [`Error::ModelMismatch`] if `weights` belongs to another model; else as
    /// [`UpdatePolicyWeights::update_group`].
    fn update_model(&mut self, model: &ModelId, weights: WeightSet) -> Result<()> {
        if weights.model() != model {
            return Err(Error::ModelMismatch {
                expected: model.to_string(),
                found: weights.model().to_string(),
            });
        }
        self.update_many(vec![weights])
    }

    /// The policy's weights.
    ///
    /// # Errors
    /// As [`UpdatePolicyWeights::update_model`].
    fn update_weights(&mut self, weights: WeightSet) -> Result<()> {
        let id = self.policy_id().clone();
        self.update_model(&id, weights)
    }

    /// The weights of `model` (any [`HasWeights`], e.g. the trainer's network).
    ///
    /// # Errors
    /// Extraction errors; else as [`UpdatePolicyWeights::update_weights`].
    fn update_policy_weights_from<M: HasWeights + ?Sized>(&mut self, model: &M) -> Result<()> {
        let ws = extract_new(&ArenaStrategy, model, self.policy_id().clone())?;
        self.update_weights(ws)
    }

    /// The weights of the registered policy.
    ///
    /// # Errors
    /// [`Error::NoRegisteredPolicy`]; else as [`UpdatePolicyWeights::update_weights`].
    fn update_policy_weights(&mut self) -> Result<()> {
        let ws = self.registered_policy_weights()?;
        self.update_weights(ws)
    }
}

impl<E: Env, P: Policy> UpdatePolicyWeights for Collector<E, P> {
    fn policy_id(&self) -> &ModelId {
        &self.config.policy_id
    }

    fn version_of(&self, model: &ModelId) -> Version {
        self.admission.current(model)
    }

    fn registered_policy_weights(&mut self) -> Result<WeightSet> {
        match &self.registered {
            Some(f) => f(&self.config.policy_id),
            None => Err(Error::NoRegisteredPolicy),
        }
    }

    fn update_group(&mut self, group: Vec<WeightSet>) -> Result<()> {
        let group: Group = group.into_iter().map(Arc::new).collect();
        self.apply_group(&group)
    }
}
